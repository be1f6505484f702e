"""The options beside [A]'s algorithm, each a named unit (variants/registry.py), chosen by flags once a run:

    registry.py      what a unit is (`Variant`: its hooks on the step's stages), REGISTRY, and the run's `Recipe`
    shaping.py       [B]'s data shaping and the null control around the advantages: null, red-drop, red-weight,
                     asymre
    corrections.py   other engines' staleness corrections around [A]'s surrogate: kl-is, opsm, decoupled, tis,
                     mis, m2po
    reinforce.py     [B]'s losses in place of the surrogate: rec, rec-is, opmd

Importing the package registers every unit: corrections.py's, reinforce.py's, then shaping.py's, each file top
to bottom. That is the order their chains run, the first outermost (a stage's units never depend on another
file's: corrections and [B]'s losses never meet, and only shaping.py's and opmd wrap the advantages).
"""

from variants import corrections, reinforce, shaping  # noqa: F401  (registers the units)
from variants.registry import REGISTRY, Recipe, Variant, recipe, register  # noqa: F401
