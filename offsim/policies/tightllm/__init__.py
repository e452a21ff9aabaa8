"""TightLLM (IEEE TC'25): KV recompute chosen per batch by an ILP (``kv_distributor``) and weight slices per batch,
on a schedule of its own (``policy``)."""
