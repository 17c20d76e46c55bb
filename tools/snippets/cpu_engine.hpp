// Prelude of the CPU engine's snippet (docs/cpp.md): what a trainer already has.
// Declarations only: tools/check-snippets.py compiles the snippet, it does not run it.
extern std::vector<stepcore::AccumulatePair> pairs;  // micro-batch gradients -> accumulators
extern std::vector<stepcore::ConstTensorView> accumulator_views;  // the f32 accumulators
extern std::vector<stepcore::OptimizerTensor> tensors;            // param, state slots, step, grad
extern stepcore::AdamWConfig adamw_config;                        // or any optimizer's Config
extern float tokens, max_norm;  // the step's loss tokens, the clip
