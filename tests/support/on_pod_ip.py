"""``python on_pod_ip.py ENGINE ARGV...``: exec the engine with ``--host $POD_IP`` appended.

Every pod of a Deployment runs the same command line and listens on its own IP. Here the "pods" share one
machine and get loopback IPs of their own (127.0.0.X): this wrapper keeps the command line (the launcher's
base, whose hash the agents compare) the same for every pod, as the kubelet would, and binds each engine
to its pod's address.
"""

import os
import sys

argv = [*sys.argv[1:], "--host", os.environ["POD_IP"]]
os.execvp(argv[0], argv)
