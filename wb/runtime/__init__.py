"""The runtime: transports, rendezvous stores, the executor of a rank's program, and the
Sender/Receiver that coordinate versions and sync modes."""
