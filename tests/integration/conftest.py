"""The Kubernetes leader's harness fixtures (tests/support/kube_harness.py: the fake API server with the chart
installed, the agent's settings and API client), defined there once for the modules of this folder that use
them."""

from tests.support.kube_harness import api, chart, kube, server, tuner_settings  # noqa: F401 (fixtures)
