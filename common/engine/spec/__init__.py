"""Speculative decoding's self-contained parts (issue #59): config (--speculative-config), proposer (the
interface and its factory), ngram (prompt lookup drafts), draft (a draft model's), eagle3 and eagle3_head (an
EAGLE-3 head's, over the target's hidden states), verify (greedy and rejection-sampled acceptance), acceptance
(each request's K from its acceptance), metrics (drafted / accepted counts)."""
