"""What is checked: loading a TARGET path, calling it through its calling convention
(``conventions``: function, module, sdpa, torch-mha, adapter), the user's ``ModuleAdapter``s
(``module_adapters``), and what the target can do and how it behaves, probed on tiny inputs
(``capabilities``, ``behaviours``)."""
