// Prelude of the GPU launchers' snippet (docs/cpp.md): device buffers the trainer owns.
// Declarations only: tools/check-snippets.py compiles the snippet, it does not run it.
extern std::vector<stepcore::TensorView> grads;         // device gradients
extern std::vector<stepcore::OptimizerTensor> tensors;  // device params, state, counters
extern stepcore::OptimizerConfig optimizer_config;      // any optimizer's Config
extern float *d_scale, *d_one, *d_clip;                 // device f32 scalars
extern std::int32_t* d_found_inf;
extern stepcore::NormPartial *d_partial, *d_exact;  // device partials
extern stepcore::NormResult* d_result;
extern stepcore::StepHyper* d_hyper;  // the schedule's lr, weight decay
extern double* d_table;               // gpu::make_optimizer_table, uploaded
extern void* d_ws;                    // the norm passes' workspace
extern std::size_t ws_bytes;
extern float max_norm;
extern cudaStream_t stream;
