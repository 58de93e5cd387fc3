"""``earl plan``: the layout selector's choices, memory and stage times for a model config on a
cluster, predicted without a device (:mod:`.plan`); its inputs (:mod:`.inputs`), its files and
printed tables (:mod:`.report`) and the command (:mod:`.command`). Top tier: it reads the recipe's
typed settings and the callback's candidate and memory-model builders."""
