"""Hooks on modules, tensors and optimizers, and what the recorder does when torch calls them.

``attach.py`` installs the process-wide module hooks and keeps the table of recorded modules
(nothing of hooktrace in the user's modules); ``names.py`` the roots and the name each module
is recorded under; ``select.py`` which modules, steps and kinds are recorded; ``calls.py``
which call of a module a hook sees, and the gradient hooks on its tensors; ``hooks.py`` what
happens when a module runs, a gradient arrives or a backward pass ends; ``compiled.py``
which modules a compiled graph's statistics belong to; ``steps.py`` the
optimizer's step that ends a step.

May import: stats, records, nonfinite, graphs.
"""
