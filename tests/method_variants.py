"""Method variants shared by the method tests and the per-family tests."""

# Every method variant that must compute exactly the base model's outputs at step 0: (name,
# options), where `strength` passes as a keyword.
STEP0_EXACT = [
    ("none", {}),
    ("lbl", {}),
    ("rpb", {}),  # its bias kept at evaluation (table 1's reading)
    ("rpb", {"keep_bias_at_eval": False}),
    ("rpb_interp", {}),
    ("rpb_interp", {"strength": 1.0}),
    ("rpb_anneal", {}),
    ("rpb_anneal", {"schedule": "linear", "bias_on": "logits", "strength": 0.0}),
    ("rpb_adaptive", {}),
    ("anchor_weight", {}),
    ("anchor_logit", {}),
    ("anchor_kl", {}),
    ("hard", {}),
    ("hard", {"gate_from": "base"}),
    ("hard", {"keep_bias_at_eval": False}),
]
