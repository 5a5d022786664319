"""The operator's side of a node: :mod:`.routes` (``/admin/*``), :mod:`.models` (their
pydantic forms), :mod:`.state` (health and stats gathered for them), :mod:`.auth` (bearer
tokens), :mod:`.tenants` (tenant tokens bound to scopes), :mod:`.metrics` (Prometheus),
:mod:`.ui` (the status page and the offline ``/docs``), :mod:`.timeseries` (the samples
and the traffic the page plots)."""
