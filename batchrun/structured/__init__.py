"""Structured outputs (JSON schema, regex, choice, EBNF grammar) through xgrammar: compiler.py."""
