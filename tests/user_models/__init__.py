"""Models written the way tutorials' readers write them: their own attention classes inside their own
architectures. Each file has a ``build()`` factory, as ``mha-deploy export --module FILE.py:build`` takes it,
and ``INPUTS``, the ``--input`` declarations of its forward."""
