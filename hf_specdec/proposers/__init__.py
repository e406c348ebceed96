"""Proposers: the ways of drafting tokens (n-gram prompt lookup, draft model, MTP heads, Top-1)."""
