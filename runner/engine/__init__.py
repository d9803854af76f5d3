"""The engine: ``train`` (``build``, the one loop ``fit``, ``summarize``) and what the loop keeps; nothing here is
imported on the package's import, so ``validate`` and the job lock load before torch."""
