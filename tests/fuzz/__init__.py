"""A property-based fuzzer (hypothesis) for every RPC of every service and the NATS subject a
service consumes: the short budget runs in `make test` (tests/integration/test_fuzz_rpc.py,
test_fuzz_nats.py), `make fuzz` runs long (`python -m tests.fuzz`, docs/failures.md)."""
