"""megatron-core pieces of the trainer: HF<->Megatron conversion, model building, process groups."""
