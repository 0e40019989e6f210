"""Speculative decoding (chapter 9): proposers (prompt lookup, a draft model), verification by rejection
sampling, and the engine that schedules drafts."""
