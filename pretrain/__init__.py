"""A Megatron-core training loop with the protected layers (``pretrain_gpt``, its flags in
``arguments``) and the demo, run from the repository root: ``python -m pretrain.demo``,
``torchrun --nproc-per-node 2 -m pretrain.pretrain_gpt --config configs/tiny_cpu.yaml``."""
