"""Host-framework integrations: the only modules that import DeepSpeed or Megatron internals."""
