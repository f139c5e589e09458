"""ringcomm-bench: nccl-tests for ringcomm, with gloo / MPI / NCCL peers side by side."""
