"""Planning: turn rule proposals into one safe ``Plan`` per cycle. Pure: ``now`` is passed in.

- ``history``: the frozen ``History`` of past cycles (streaks, changes, restarts, crash memory).
- ``guards``: one function per guard, each returning a ``Ruling`` with a reason; their settings.
- ``planner``: ``plan(...) -> Plan`` and ``DecisionSettings`` (config key ``decisions:``).
"""
