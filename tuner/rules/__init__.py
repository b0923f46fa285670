"""Rules: declarative "when these signals, change that flag" statements, validated and evaluated purely.

- ``schema``: the pydantic models of a rule file (docs/rules.md describes the format).
- ``loading``: YAML → ``RuleSet``, or a ``ConfigError`` naming file, rule id and field.
- ``evaluation``: (rules, signals, current args, streaks) → one ``Outcome`` per rule, with proposals.

The YAML lives in the top-level ``rules/`` directory (default.yaml, seed-h100.yaml).
"""
