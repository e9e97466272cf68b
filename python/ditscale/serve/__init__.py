"""A generation server over a sequence-parallel diffusers pipeline group.

``python -m ditscale.serve --pipeline flux|sd3|wan|wan2.2|hunyuan-video|cogvideox`` under
``torchrun`` (one process per GPU; ``--device cpu`` with gloo): OpenAI-style
``POST /v1/images/generations`` and ``/v1/videos/generations``, jobs with progress and
server-sent events, cancellation, timeouts, a bounded queue, ``/health`` and ``/metrics``.
The manual is docs/serve.md. Modules, one idea each:

- ``cli``: the command line, process setup, signals
- ``options``: the options and their ranges
- ``schema``: a request's JSON validated into a ``Request``
- ``jobs``: jobs and the bounded queue
- ``runner``: a batch's pipeline call on one rank, per-step control
- ``group``: the control plane among the ranks (gloo)
- ``server``: rank 0's worker loop, the other ranks' loop, results
- ``http``: routes and HTTP details
- ``metrics``: the Prometheus text
"""
