"""Deployment tooling (not installed with the package): the Helm chart renderer used to check
``k8s/`` without Helm, and the index of the ``COSINE_*`` settings each service accepts."""
