"""What a Python worker sets up around a job's tasks: the job's staged
dependencies installed once per host (``dependencies``) and the capture of
what its code logs, forwarded to the job's messages (``logs``)."""
