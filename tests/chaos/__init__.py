"""`make chaos`: the fault suite (python -m tests.chaos); one network namespace per run."""
