# Call 0 (what the device time left allows): the in-place unpacks' GPU test and the JAX GPU tests.
source bench/gpu_common.sh
WB_UNPACK_IN_PLACE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  "tests/test_transfer_cuda.py::test_receives_are_unpacked_from_the_senders_memory" \
  tests/test_jax_cuda.py 2>&1 | tail -15 | tee $OUT/tests0.txt
