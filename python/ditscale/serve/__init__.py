"""A generation server over a sequence-parallel diffusers pipeline group.

``python -m ditscale.serve --pipeline flux|sd3|wan|wan2.2|hunyuan-video|cogvideox`` under
``torchrun`` (one process per GPU; ``--device cpu`` with gloo): OpenAI-style
``POST /v1/images/generations`` and ``/v1/videos/generations``, jobs with progress and
server-sent events, cancellation, timeouts, a bounded queue, ``/health`` and ``/metrics``.
The manual is docs/serve.md; the modules, one idea each, are listed in docs/architecture.md
(HTTP: ``transport`` / ``app`` / ``reading`` / ``body`` / ``waiting`` on FastAPI and uvicorn;
requests: ``schema``, ``jobs``; the group: ``group``, ``runner``, ``server``).
"""
