"""Starting a job's processes and meeting: launcher detection (launchers, hostlist), the rendezvous
in the job's store (rendezvous), a membership's group made (start), ``from_env`` and ``launch``, and
the ``run`` agent with its supervision (agent, supervise, rank_output)."""
