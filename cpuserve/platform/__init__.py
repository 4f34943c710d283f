"""Platform layer: what this machine is (detection) and what cpuserve will do on it (plan).

Detection reads only files (/proc, /sys) under a root directory, so recorded trees from other
machines can be fed to the same code in tests.
"""
