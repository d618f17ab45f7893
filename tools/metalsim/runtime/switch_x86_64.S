// Fiber context switch for libmslsim (x86-64 System V). Saves only what the ABI makes callee-saved
// (rbx, rbp, r12-r15, the MXCSR and x87 control words); no signal mask, which is what makes ucontext slow.
    .text
    .globl  mslsim_swap_context
    .hidden mslsim_swap_context
    .type   mslsim_swap_context, @function
// void mslsim_swap_context(void** save_sp /* rdi */, void* new_sp /* rsi */)
mslsim_swap_context:
    .cfi_startproc
    pushq   %rbp
    pushq   %rbx
    pushq   %r12
    pushq   %r13
    pushq   %r14
    pushq   %r15
    subq    $8, %rsp
    stmxcsr (%rsp)
    fnstcw  4(%rsp)
    movq    %rsp, (%rdi)
    movq    %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw   4(%rsp)
    addq    $8, %rsp
    popq    %r15
    popq    %r14
    popq    %r13
    popq    %r12
    popq    %rbx
    popq    %rbp
    ret
    .cfi_endproc
    .size   mslsim_swap_context, .-mslsim_swap_context

    .globl  mslsim_fiber_entry
    .hidden mslsim_fiber_entry
    .type   mslsim_fiber_entry, @function
// First code a new fiber runs (reached by the `ret` above): the lane pointer was planted in r12.
mslsim_fiber_entry:
    .cfi_startproc
    .cfi_undefined rip
    movq    %r12, %rdi
    call    mslsim_lane_main
    ud2
    .cfi_endproc
    .size   mslsim_fiber_entry, .-mslsim_fiber_entry

    .section .note.GNU-stack,"",@progbits
