"""The ground floor: what the tuner shares with the programs that run beside the engine, standard library only.

- ``untrusted``: the one bounded reader of files and documents another party writes;
- ``argv``: the one writer (and reader) of an engine's command line;
- ``secrets``: the one list of secret flags and variables, and their mask;
- ``pod_protocol``: the files the Kubernetes agent and the in-pod launcher share (``desired.json``,
  ``status.json``, ``allowed-flags.json``);
- ``live_protocol``: the live-knob files the tuner and the engine-side plugin share (``control.json``,
  ``ack-<rank>.json``).

The in-pod launcher (``tuner/launcher``, run by the engine image's Python) carries this package in its
zipapp, and the plugin (``plugin/``, in vLLM's environment) carries ``untrusted.py`` and ``live_protocol.py``
byte for byte (as ``protocol.py``); tests hold the copies equal. So nothing here imports anything but the
standard library and this package (import-linter holds that), and every import inside it is relative.
"""
