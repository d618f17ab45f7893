// objc_msgSend and friends for the fake Objective-C runtime (x86-64 System V).
//
// metal-cpp casts objc_msgSend to the typed function pointer of each message, so the trampoline must hand
// every argument through untouched: it saves the six integer argument registers, rax (the vector-register
// count of variadic calls) and xmm0-7, asks fakemetal_lookup(self, sel) for the C++ implementation, restores
// everything and tail-jumps to it. The stack is left exactly as the caller built it, so arguments passed in
// memory (MTL::Size by value: 24 bytes) are where the implementation expects them.
// _stret: a struct of more than 16 bytes is returned through a hidden pointer in rdi, so self and the
// selector arrive in rsi and rdx; a C++ function returning that struct by value has the same ABI.
// _fpret: identical to objc_msgSend on x86-64 for float and double returns (xmm0).

    .text

.macro FAKEMETAL_TRAMPOLINE name, self_reg, sel_reg
    .globl \name
    .type \name, @function
    .p2align 4
\name:
    .cfi_startproc
    pushq %rbp
    .cfi_def_cfa_offset 16
    .cfi_offset %rbp, -16
    movq %rsp, %rbp
    .cfi_def_cfa_register %rbp
    subq $192, %rsp                 // 7 GPRs + 8 XMMs = 184 bytes; keeps rsp 16-byte aligned for the call
    movq %rdi, 0(%rsp)
    movq %rsi, 8(%rsp)
    movq %rdx, 16(%rsp)
    movq %rcx, 24(%rsp)
    movq %r8, 32(%rsp)
    movq %r9, 40(%rsp)
    movq %rax, 48(%rsp)
    movdqu %xmm0, 56(%rsp)
    movdqu %xmm1, 72(%rsp)
    movdqu %xmm2, 88(%rsp)
    movdqu %xmm3, 104(%rsp)
    movdqu %xmm4, 120(%rsp)
    movdqu %xmm5, 136(%rsp)
    movdqu %xmm6, 152(%rsp)
    movdqu %xmm7, 168(%rsp)
    movq \self_reg, %rdi
    movq \sel_reg, %rsi
    call fakemetal_lookup@PLT
    movq %rax, %r11
    movq 0(%rsp), %rdi
    movq 8(%rsp), %rsi
    movq 16(%rsp), %rdx
    movq 24(%rsp), %rcx
    movq 32(%rsp), %r8
    movq 40(%rsp), %r9
    movq 48(%rsp), %rax
    movdqu 56(%rsp), %xmm0
    movdqu 72(%rsp), %xmm1
    movdqu 88(%rsp), %xmm2
    movdqu 104(%rsp), %xmm3
    movdqu 120(%rsp), %xmm4
    movdqu 136(%rsp), %xmm5
    movdqu 152(%rsp), %xmm6
    movdqu 168(%rsp), %xmm7
    leave
    .cfi_def_cfa %rsp, 8
    jmp *%r11
    .cfi_endproc
    .size \name, .-\name
.endm

FAKEMETAL_TRAMPOLINE objc_msgSend, %rdi, %rsi
FAKEMETAL_TRAMPOLINE objc_msgSend_fpret, %rdi, %rsi
FAKEMETAL_TRAMPOLINE objc_msgSend_stret, %rsi, %rdx

// A message to nil returns zero in every return register (integers, pointers, floats, small structs).
    .globl fakemetal_nil_imp
    .hidden fakemetal_nil_imp
    .type fakemetal_nil_imp, @function
    .p2align 4
fakemetal_nil_imp:
    .cfi_startproc
    xorl %eax, %eax
    xorl %edx, %edx
    pxor %xmm0, %xmm0
    pxor %xmm1, %xmm1
    ret
    .cfi_endproc
    .size fakemetal_nil_imp, .-fakemetal_nil_imp

    .section .note.GNU-stack,"",@progbits
