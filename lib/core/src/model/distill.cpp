#include "kv/model/distill.hpp"

#include <cmath>

namespace kv {

torch::Tensor distillation_loss(const torch::Tensor& student_logits, const TeacherAnswer& teacher) {
    const int64_t length = static_cast<int64_t>(teacher.tokens.size());
    const torch::Tensor student = torch::log_softmax(student_logits.to(torch::kFloat32), 1);
    const torch::Tensor candidates =
        torch::from_blob(const_cast<int32_t*>(teacher.candidates.data()), {length, teacher.top_k},
                         torch::kInt32)
            .to(student.device(), torch::kInt64);
    const torch::Tensor teacher_log =
        torch::from_blob(const_cast<float*>(teacher.log_probabilities.data()),
                         {length, teacher.top_k}, torch::kFloat32)
            .to(student.device());
    const torch::Tensor teacher_p = teacher_log.exp();
    const torch::Tensor student_kept = student.gather(1, candidates);
    torch::Tensor loss = (teacher_p * (teacher_log - student_kept)).sum();
    if (teacher.top_k < student.size(1)) {
        const torch::Tensor teacher_rest = (1.0 - teacher_p.sum(1)).clamp_min(0.0);
        const torch::Tensor student_rest = (1.0 - student_kept.exp().sum(1)).clamp_min(1e-12);
        const torch::Tensor present = teacher_rest > 1e-9;
        const torch::Tensor term =
            teacher_rest * (teacher_rest.clamp_min(1e-12).log() - student_rest.log());
        loss = loss + torch::where(present, term, torch::zeros_like(term)).sum();
    }
    return loss;
}

void AdamW::step(torch::Tensor& parameter, const torch::Tensor& gradient, int64_t step_number,
                 double learning_rate) {
    constexpr double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
    torch::NoGradGuard no_grad;
    moment.mul_(beta1).add_(gradient, 1 - beta1);
    second_moment.mul_(beta2).addcmul_(gradient, gradient, 1 - beta2);
    const double correction1 = 1 - std::pow(beta1, static_cast<double>(step_number));
    const double correction2 = 1 - std::pow(beta2, static_cast<double>(step_number));
    const torch::Tensor denominator = (second_moment.sqrt() / std::sqrt(correction2)).add_(epsilon);
    parameter.addcdiv_(moment, denominator, -learning_rate / correction1);
}

}  // namespace kv
