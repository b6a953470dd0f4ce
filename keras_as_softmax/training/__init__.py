"""AS-Speed training: the `ASSpeed` wrapper, its accumulation core, and the
per-backend trainers."""
