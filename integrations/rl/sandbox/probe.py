"""Run in the sandbox once per setting: it must not be able to become root or hold any capability.

Exit status 0: unprivileged, as required; 3: it could (the reason on stdout). Running at all also
shows that the sandbox's interpreter finds this package.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        os.setuid(0)
    except OSError:
        pass
    else:
        print("setuid(0) worked")
        return 3
    with open("/proc/self/status") as f:
        caps = {line.split()[0]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}
    if os.getuid() == 0 or any(caps.values()):
        print(f"uid {os.getuid()}, capabilities {caps}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
