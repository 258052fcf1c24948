"""The command line's subcommands beyond ``run``: ``env``, ``check`` and ``bench``
(``python -m distcomm``; see ``distcomm.__main__``)."""
