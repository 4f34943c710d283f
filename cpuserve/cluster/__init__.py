"""cpuserve past one machine: engine replicas on Ray Serve behind one OpenAI-compatible ingress.

Needs the optional `cluster` extra (`pip install cpuserve[cluster]`: Ray Serve); nothing else in
cpuserve imports this package.
"""

APP_NAME = "cpuserve"  # the Ray Serve application's name (app.py deploys it, ingress.py reports on it)
