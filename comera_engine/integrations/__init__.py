"""CoMERA inside training frameworks that own the loop.

* :mod:`.huggingface`: ``CoMERACallback``, a ``transformers.Trainer`` callback (needs
  ``transformers`` and ``accelerate``; imported only when you import it).
"""
