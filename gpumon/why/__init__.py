"""``gpumon why``: a job's post-mortem from its nodes' health history (issue 21).

job.py resolves the job (Slurm, or explicit nodes and window), collect.py asks every node's query
API (gpumon.export.api) in parallel, joblog.py reads the job's NCCL/watchdog lines, reason.py
ranks the suspects, report.py prints the table or the JSON.
"""
