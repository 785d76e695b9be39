"""argparse whose usage errors exit 3 ("could not judge"), not argparse's 2.

Exit 2 means "a check failed" to every reader of gpumon's exit code (contrib/slurm-healthcheck.sh
drains the node on it, NHC and node-problem-detector count it as a problem). argparse exits 2 on
an unknown flag: one bad rollout of GPUMON_ARGS would then drain every node of a cluster. A usage
error is gpumon not running, so it gets the code of gpumon not running.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 3  # = EXIT_CANNOT_RUN of gpumon.cli (the Nagios/NHC "unknown")


class UsageParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through add_subparsers, every subcommand's) exiting 3 on bad usage."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: usage error (exit {EXIT_USAGE}, nothing was checked): "
                              f"{message}\n")
