"""The protected Megatron-core layers the spec puts in place: the QKV and output projections
(``linear``), the unfused core attention (``attention``) and the flash one
(``flash_attention``). Each owns a guard a section and checks its own tensor-parallel shard."""
