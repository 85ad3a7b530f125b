"""Compile every Triton kernel the patches launch, for AMD gfx942/gfx950, on a machine without an AMD GPU.

Why: the users run MI300X (gfx942) and MI350X/MI355X (gfx950); no AMD GPU is reachable
where this project is built and tested, yet Triton's AMD backend ships in every ``triton``
wheel and compiles without a device. ``aiter-patches compile`` drives the project's own
launchers with CPU tensors under a fake driver that answers as a ROCm device would, records
each variant a launch would compile (``knobs.runtime.jit_cache_hook``, nothing launches),
compiles each one for the arch and reports its registers, spills, scratch and LDS. With
``--cache-dir`` the compiled kernels land in a Triton cache that a ROCm server with the same
Triton build hits without compiling.

One module per job: ``presets`` (model shapes), ``sweep`` (the launcher calls a server
makes), ``capture`` (the fake driver and the hook), ``compile`` (one variant to amdgcn and
hsaco, in a process pool), ``resources`` (registers, spills, LDS, occupancy from the
amdgcn), ``covering`` (a pairwise-covering subset for CI), ``report`` (the table and the
verdict), ``command`` (the CLI glue).

Nothing here is imported by ``import aiter_patches``; triton's AMD pieces are imported only
when a compile runs.
"""
