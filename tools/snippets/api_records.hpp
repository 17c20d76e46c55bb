// Prelude of docs/api-changes.md's record snippets: a tensor's buffers and the step's
// scalars, host and device. Declarations only: the snippets are compiled, not run.
extern std::size_t n, i;                             // tensors, and one of them
extern stepcore::TensorView param, m, v, bf16_copy;  // f32 param and moments, bf16 copy
extern stepcore::ConstTensorView grad;
extern float step, scale, clip;
extern stepcore::cpu::Engine engine;
extern stepcore::AdamWConfig adamw_config;
extern std::span<const stepcore::OptimizerTensor> d_t;  // device records
extern float *d_scale, *d_clip;
extern std::int32_t* d_found_inf;
extern stepcore::StepHyper* d_hyper;
extern double *d_bias, *d_table;
extern cudaStream_t stream;
