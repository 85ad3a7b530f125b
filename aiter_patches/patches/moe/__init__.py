"""The MoE pipeline's machinery, shared by the MoE patches: one wrapper per AITER target
(``pipeline``), the per-call plan (``call``) and the reused sort outputs (``sort_scratch``)."""
