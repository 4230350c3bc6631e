"""The fleet as one gateway sees it: its backends (``backends``: health, circuits,
their events and load followed), the check a backend passes when it joins
(``backend_check``), the load counted on each replica (``load``, live and in the
replayer alike), which replicas serve which model (``models``), the request path's HTTP
client (``http_client``) and the rule that grows and shrinks it (``autoscaler``)."""
