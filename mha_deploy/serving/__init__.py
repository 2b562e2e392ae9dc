"""Serving an exported model: the HTTP server (``http/``) and Triton model repositories (``triton``). No torch.

The session and the batch runner are ``mha_deploy.runtime.MHASession`` and
``mha_deploy.batch.BatchRunner``.
"""
