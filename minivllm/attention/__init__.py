"""Attention backends: each writes the new keys and values where its cache keeps them and attends, behind
one interface (`AttentionMetadata.attend`): no cache (chapter 1), the paged reference (chapter 5), Triton
kernels (chapter 8)."""
