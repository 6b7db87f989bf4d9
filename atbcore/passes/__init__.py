"""Graph passes: pure ``Graph -> Graph`` functions, one per file, run in one
visible order by :func:`~.pipeline.run_pipeline`; fusion rules are data
(:mod:`.rules`), applied by one driver (:mod:`.rewrite`)."""
