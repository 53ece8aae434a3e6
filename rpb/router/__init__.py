"""What a router is, to rpb: a description of what a router class computes, the routing that
description gives, and the check that it is the module's own, bit for bit.

- `spec`: `RouterSpec`, what a router's forward computes, in a few orthogonal settings (or
  `UnsupportedRouter`, why rpb refuses a class). Torch-free: rpb.families is pure data on it.
- `route`: the routing a description gives: a router's handle (the module and its description),
  its logits along the library's dtype path, its selection and gate weights (optionally biased or
  forced), the routing distribution, and the adapters between a router's own output and
  (logits, weights, indices).
- `check`: a description is used only once it reproduces the module's forward on a probe batch,
  bit-exactly (cached per class and configuration).

How rpb controls the routers of a model (finding them, hooks, steering policies, the
`RouterControl` users touch) is rpb.routing, the user-facing module, which re-exports what users
need from here. This package imports nothing at its top, so importing `rpb.router.spec` stays
torch-free.
"""
