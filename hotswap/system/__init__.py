"""The operating system's side of the workers: process trees and their memory, and CPU priority."""
