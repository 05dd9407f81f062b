"""The cluster a job runs on: rendezvous store wiring, model-parallel group creation, NCCL
settings, start-up timing (bootstrap) and node self-checks."""
