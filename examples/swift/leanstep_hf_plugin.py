# ms-swift plugin for the transformers backend: `swift sft ... --external_plugins
# examples/swift/leanstep_hf_plugin.py --callbacks leanstep`. Registers the "leanstep"
# callback; the RMSNorm swap and the clipping are applied when training begins
# (see leanstep.transformers.swift), not at import.
import leanstep.transformers.swift as s

s.register()
