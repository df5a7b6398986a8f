# Sourced by the bench/gpu_*.sh scripts on the H200 device machine: installs the carried ucxx
# wheels (.whl/, Python 3.12; see bench/results/h200_transfer/COMMAND.md) into /tmp/site, sets
# the environment, makes $OUT, and defines mps_on/mps_off: the CUDA MPS daemon started as this
# user (pipes in /tmp) so that processes share the GPU at once instead of time-slicing it; MPS
# changes no GPU setting, and mps_off stops it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started" | tee -a "$OUT/device.txt"
}
mps_off() { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
