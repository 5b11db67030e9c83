"""Speculative decoding's self-contained parts (issue #59): config (--speculative-config), proposer (the
interface and its factory), ngram (prompt lookup drafts), verify (greedy and rejection-sampled acceptance),
acceptance (each request's K from its acceptance), metrics (drafted / accepted counts)."""
